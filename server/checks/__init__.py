"""What a shard checks of the updates it merges: the per-round figures (`round_figures`), the verdicts
judged from them (`update_check`) and what a close reads off them (`site_verdict`), and the robust mean
that bounds any minority's weight (`robust_mean`)."""
