"""Planned offloading (LazyTrain, arXiv 2608.11919): the runtime that carries an offload plan out.

  config.py    OffloadConfig (torch-free) and memory sizes as text <-> bytes
  plan.py      OffloadPlan: the contract between the planner (student/planner/) and the runtime
  runtime.py   OffloadRuntime: bf16 working weights streamed per layer, fp32 masters, gradients and
               states in pinned host memory, activations kept, recomputed or offloaded
  update.py    the host layers and the ring that updates them on the GPU, overlapping the next step
  streams.py   the side streams and events the runtime and the ring copy on
  clock.py     the runtime's phase clock (what a metrics row reports beside the plan's prediction)
  run.py       the trainer's side: the plan a run trains with, its figures, the allocator cap

No imports here: importing student.offload.config must not load torch.
"""
