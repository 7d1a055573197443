"""A shard's state on disk and across restarts: checkpoints and their signatures (`checkpoint`,
`checkpoint_signing`), the provenance chain of published versions (`provenance_chain`), the resume rules
(`resume`), what the run recorded of itself (`run_record`), the rounds kept on disk for sites that come
back after a day (`rounds_on_disk`) and the one file layout both use (`contribution_state`)."""
