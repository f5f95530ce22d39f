"""The rangers' web view (issue 9): location protection first; the FastAPI app, accounts and pages follow."""
