"""Multi-host start shared by the launchers: flags -> `jax.distributed.initialize`."""

from absl import flags, logging

flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
flags.DEFINE_integer("num_processes", None, "Number of processes.")
flags.DEFINE_integer("process_id", None, "This process's index.")
flags.DEFINE_bool("tpu_pod", False, "Initialize from the TPU pod environment (no other flags needed).")
flags.DEFINE_integer("cpu_devices", None, "Simulate this many CPU devices per process (testing).")


def _check_port(address: str) -> None:
    """Process 0 serves the coordinator at `address`: a port in use is a user error, said up front
    (JAX would only report "Failed to start RPC server")."""
    import errno
    import socket

    from codedance_jax.errors import ConfigError

    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--coordinator_address={address}: expected HOST:PORT", "e.g. --coordinator_address=10.0.0.1:8476")
    del host  # JAX's coordinator listens on all interfaces
    with socket.socket() as s:
        try:
            s.bind(("", int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--coordinator_address={address}: port {port} is in use",
                                  "stop the process holding it or choose another port") from e
            raise


def initialize():
    import jax

    f = flags.FLAGS
    if f.coordinator_address and not f.process_id:
        _check_port(f.coordinator_address)
    if f.cpu_devices:
        jax.config.update("jax_num_cpu_devices", f.cpu_devices)
    if f.coordinator_address:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # no-op off CPU
        jax.distributed.initialize(f.coordinator_address, num_processes=f.num_processes, process_id=f.process_id)
    elif f.tpu_pod:
        jax.distributed.initialize()
    logging.info("process %d/%d, %d local / %d global devices", jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count())
