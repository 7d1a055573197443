"""Inner training: one process (`InnerTrainer`) or a pipeline of stages (`PipelineTrainer`) over a
PP × DP layout inside a site, launched under `torchrun`."""
