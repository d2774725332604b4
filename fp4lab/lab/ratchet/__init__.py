"""The autoresearch commit/revert loop (`loop`), the proposers it asks for changes (`proposers`) and the report of its iterations (`report`)."""
