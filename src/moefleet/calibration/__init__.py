"""Calibration: measure a real backend, and hand the numbers to the models that predict it.

Every calibration in moefleet lives here, one module a model:

- :mod:`~moefleet.calibration.sim`: the simulator's per-kind call overheads, cold start
  and compute scale from a measured run's invocation records (``calibrate``);
- :mod:`~moefleet.calibration.odsbo`: ODS/BO's cost model's platform terms (T_acc, B_s,
  T_warm) timed on a backend's store and a one-worker run (``measure_store``,
  ``calibrated_platform``);
- :mod:`~moefleet.calibration.remoe`: Remoe's per-part times (non-experts, local experts,
  a nested call's overhead) from in-process engine steps and a deployed all-remote plan;
- :mod:`~moefleet.calibration.smoe_online`: the simulator fitted to the sMoE online run's
  warm-up requests on the local backend.

Layer: above ``compose``, ``remoe`` and ``runtime`` (it opens engines and deploys plans to
measure them), below the CLI and the experiments. The models it calibrates (``plan``,
``sim``) never import it: they own the data types a calibration fills in
(``sim.config.Calibration``, ``plan.remoe.problem.RemoeProblem``, ``PlatformSpec``).
"""
