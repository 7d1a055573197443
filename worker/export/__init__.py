"""The trained model out of the run: `dilocox export` and `dilocox verify`.

* `model` — the global model read from live shards or their checkpoints;
* `export_folder` — it written as loadable files (and evaluated from them);
* `export_cli` — `dilocox export`: its flags and what it runs;
* `checkpoints` — which shard checkpoint files one version's export reads;
* `provenance` and `chain` — what the export says it came from, checked against the shards' chain of rounds;
* `signing` and `openssf` — the folder's signature (this project's, and OpenSSF model-signing's);
* `verify` — `dilocox verify`: a signed export's signature, digests and file list.
"""
