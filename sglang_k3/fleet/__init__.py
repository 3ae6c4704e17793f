"""The fleet layer: several instances behind sglang-router, sharing states through Mooncake.

- :mod:`admission`: per-class admission budgets of one instance (torch-free);
- :mod:`instance_info`: ``GET /k3_fleet_info`` (sessions held, admission) on each instance;
- :mod:`launch_router`: sglang-router's launcher with its ``consistent_hashing`` policy selectable;
- :mod:`instance`, :mod:`router_process`, :mod:`local_fleet`: start and stop the processes;
- :mod:`status`: one line per instance (load, hit rate per tier, sessions held).
"""
