"""The offload planner: profiles a training step through the public step functions
(student/step.py) and solves for the fastest OffloadPlan under GPU and host budgets. It sits below
the trainer: it imports the step, never the loop.

  profile.py   measures the step: per-layer times, bytes, copy rates, the clock under load
  table.py     the cost table the profile fills (per-layer costs, key/value pages, chunk timings)
  costs.py     the cost model: a plan's predicted step time and phases
  peaks.py     the predicted GPU and host memory peaks of a plan
  solve.py     the mixed-integer program (SciPy milp, HiGHS), budgets, chunk-size choice
  report.py    `distill plan`'s table

No imports here, so that its modules load only what they need.
"""
