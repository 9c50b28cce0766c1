"""The state database: the journal of runs, incidents and actions, its files, the history."""
