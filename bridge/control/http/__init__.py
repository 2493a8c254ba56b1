"""The controller over HTTP: the FastAPI service and its lean hot routes, the front door
(framing, body and JSON bounds, authentication, connection bounds, off-GIL parsing),
Prometheus `/metrics`, and the worker's typed client. It parses, authenticates, calls the
controller and serializes; the decisions are the controller's."""
