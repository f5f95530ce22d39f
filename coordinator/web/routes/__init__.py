"""The web view's routes, one FastAPI router per page group (coordinator.web.app includes them in this order)."""
