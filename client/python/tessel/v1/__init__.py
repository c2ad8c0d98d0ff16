# Generated gRPC/protobuf stubs for tessel.v1 land here at build time
# (setup.py); they are not committed.
