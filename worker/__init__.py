"""DiLoCoX worker package."""
