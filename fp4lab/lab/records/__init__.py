"""What runs leave behind: the catalog (`catalog`), log verdicts (`logscan`), the ledger and plots (`report`)."""
