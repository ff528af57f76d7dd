"""Chunk-recurrent training of long sequences with a paged key/value store (OOMB, arXiv 2602.02108).

A micro-batch's sequences run chunk by chunk with the gradient of full backpropagation, exactly,
while the activations held at once are those of one chunk; keys and values live in pages, on the
GPU or in pinned host memory. Three modules, imported by their full names (this file imports
nothing, so importing the config does not import torch):

  config.py  LongContextConfig (the `long` part of TrainConfig) and the chunk arithmetic the
             planner prices: `chunk_bounds`, `kept_chunks`. Torch-free, for the CLI.
  store.py   PagedKVStore, the attention seam of student.model.Student that keeps the pages and
             attends over them (kernels/page_attention.py), offloaded page sets copied on a side
             stream, sparse page selection; `store_for_model` builds one.
  engine.py  the two passes: `chunk_recurrent_backward` (training) and `chunked_forward`
             (evaluation), and `Part`, what a chunk is of its micro-batch.

The paper's reference code moves a whole layer's pages between host and GPU at once and its
rectangular backend drops the past pages' gradients; neither is done here.
"""
