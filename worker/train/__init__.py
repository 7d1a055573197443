"""Inner training in one process (`InnerTrainer`), the model's pipeline stages (`pipeline_stage`) and the
device/precision choice (`device`). A torchrun site's trainer is `worker.site.trainer.SiteTrainer`."""
