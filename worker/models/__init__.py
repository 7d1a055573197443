"""Model builders for a cluster's trainer. The aggregation service never imports these."""
