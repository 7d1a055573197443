"""One cluster: the trainer side and the exchange side of a DiLoCoX worker.

* `models/`   — model builders (the built-in byte-level GPT; model code a run brings goes here too).
* `data/`     — corpora, tokenisation and batches.
* `train/`    — inner training: the single-process `InnerTrainer`, pipeline stages and schedules, the
  PP × DP layout inside a site and its `torchrun` launch.
* `exchange/` — talking to the shards: the DiLoCo round loop, the background communicator, the
  aggregator client (compression, replay of the outer step), adaptive H.
* root        — the `dilocox worker` and `dilocox status` commands, the worker checkpoint, metrics, progress.
"""
