"""Remoe's execution half: the main function (engine + KV cache + non-experts + local
experts in one invocation) and its remote expert functions.

- :mod:`.messages`: the main function's typed messages (``Generate``, ``Result``);
- :mod:`.handler`: ``main_handler``, the function factory deploy names for a plan's main;
- :mod:`.run`: deploy-side driver: overlapped cold start, batches, metering, GPU-emulated
  pricing of the main function.

The split of a layer's experts between the main function and the remote functions is
:class:`moefleet.experts.split.SplitExperts`; the planner is :mod:`moefleet.plan.remoe`.
"""
