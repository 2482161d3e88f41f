"""PySpark data source, sink and batch / streaming jobs over the gateway's queues.

Optional: needs the `[spark]` extra (pyspark, pyarrow, pandas). `source.GatewayDataSource`
is registered under the name ``gateway`` for both reads and writes.
"""
