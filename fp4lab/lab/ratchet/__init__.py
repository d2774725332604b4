"""The autoresearch commit/revert loop (`loop`) and the proposers it asks for changes (`proposers`)."""
