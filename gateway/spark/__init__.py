"""PySpark data source, sink and batch / streaming jobs over the gateway's queues.

Optional: needs the `[spark]` extra (pyspark, pyarrow, pandas). `source.GatewayDataSource`
is registered under the name ``gateway`` for both reads and writes.
"""

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
