"""The coordinator: the named actor clients reach, in front of the engines (one per replica)."""
