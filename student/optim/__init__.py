"""Memory-lean optimizers for stage two.

  config.py    OptimizerConfig (torch-free: the CLI's options)
  build.py     build_optimizer (AdamW, FOAM or 8-bit AdamW), state_bytes, resuming a state
  foam.py      FOAM (block-folded states); adam8bit.py: 8-bit block-wise states
  clip.py      global-norm clipping; plans.py, shards.py: the optimizers' launch plans and shards

No imports here: importing student.optim.config must not load torch.
"""
