"""What a shard checks of the updates it merges: the per-round figures (`round_figures`), the verdicts
judged from them (`update_check`) and the robust mean that bounds any minority's weight (`robust_mean`)."""
