"""The main process's torch-free request front: what every API (HTTP, OpenAI, gRPC, the Engine)
checks and reports the same way. It never imports runtime/server/, the adapters that use it."""
