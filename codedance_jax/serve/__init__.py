"""An OpenAI-compatible server over the model and the rollout sampler (`python -m launch.serve`).

    from codedance_jax.serve import Server, ServeConfig, serve
    serve("/path/to/checkpoint", port=8000)            # blocks; or build Server(model, processor).app

Files: app.py (routes, responses, SSE), schema.py (request validation), messages.py (chat template,
images), batcher.py (continuous batching on the jitted sampler), agent.py (agent mode: rollouts with
the sandbox), errors.py (OpenAI-style errors), server.py (load, bind, uvicorn).
Imports only the library core and the sandbox.
"""

from codedance_jax.serve.app import ServeConfig, Server
from codedance_jax.serve.errors import APIError
from codedance_jax.serve.server import StartError, serve

__all__ = ["APIError", "ServeConfig", "Server", "StartError", "serve"]
