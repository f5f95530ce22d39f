"""The rangers' web view (docs/web.md): location protection first; the FastAPI app, accounts and pages follow."""
