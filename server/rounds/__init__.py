"""A shard's rounds: what a round holds while sites push (`round_state`), when it closes and with whom
(`round_close`, the grace window of `grace`), the close itself (`shard_close`), and the recent versions'
contributions kept in memory for sites that come back behind (`recent_rounds`)."""
