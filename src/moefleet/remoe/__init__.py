"""Remoe's execution half: the main function (engine + KV cache + non-experts + local
experts in one invocation) and its remote expert functions.

- :mod:`.split`: ``split_experts`` (local and remote experts of a layer, concurrently),
  ``held_experts`` (the main function's own experts), ``mask_ids``;
- :mod:`.messages`: the main function's typed messages (``Generate``, ``Result``);
- :mod:`.handler`: ``main_handler``, the function factory deploy names for a plan's main;
- :mod:`.run`: deploy-side driver: overlapped cold start, batches, metering, GPU-emulated
  pricing of the main function.

The planner is :mod:`moefleet.plan.remoe`.
"""
