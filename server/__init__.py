"""DiLoCoX server package."""
