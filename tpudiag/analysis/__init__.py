"""Analysis: pure functions over records and columns."""
