"""Same-host regions: shared memory a client on the service's host hands over a Unix socket, so
that no tensor byte crosses a socket. Both ends live here:

    memfd.py     sealed, populated anonymous memory (made by the client, checked by the service)
    protocol.py  the socket's frames, and the one reader of them
    registry.py  the service's regions by handle, their limits and their checks
    server.py    the service's end of the socket
    client.py    the client's end: registration, regions, places of tensors
"""
