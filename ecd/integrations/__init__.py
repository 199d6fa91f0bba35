"""Engine integrations built on ecd.Client. Each imports its engine lazily."""
