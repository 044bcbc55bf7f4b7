"""The graded tests (a package, so their module names never clash with tests/test_<stem>.py)."""
