"""Running a learner's part inside the real engine, step by step, and comparing it with labkit's own.
Used by the Build tasks' checkers (notebooks 02-13)."""
