"""The fleet replay's parts: models of sglang-router's policies (:mod:`routing`) and the fleet's
simulated-time loop (:mod:`sim`). ``benchmarks/fleet_replay.py`` is the command."""
