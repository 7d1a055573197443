"""DiLoCoX proto package."""
