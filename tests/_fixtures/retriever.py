"""Session fixture `retriever_server` (filled in with the retriever service)."""
