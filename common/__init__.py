"""DiLoCoX common package."""
