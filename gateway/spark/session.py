"""SparkSession for the pipeline: local by default, but never overriding spark-submit.

Local runs pin the Python workers to this interpreter (the one with the gateway package
installed) and keep the driver on loopback; under spark-submit the cluster decides.
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from gateway.spark.source import GatewayDataSource


def under_spark_submit() -> bool:
    """spark-submit starts the JVM first and hands Python its gateway port."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def build_session(
    app_name: str = "gateway-pipeline",
    master: str | None = None,
    *,
    shuffle_partitions: int | None = None,
    ui: bool = True,
) -> SparkSession:
    """A session with the `gateway` data source registered."""
    builder = SparkSession.builder.appName(app_name)
    if not under_spark_submit():
        # workers must import `gateway`: the interpreter that has it installed is this one
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # every listener on loopback, no warning
        builder = (
            builder.master(master or "local[*]")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
        )
    elif master:
        builder = builder.master(master)
    if not ui:
        builder = builder.config("spark.ui.enabled", "false")
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    spark = builder.getOrCreate()
    spark.dataSource.register(GatewayDataSource)
    return spark


def activate(spark: SparkSession) -> None:
    """Make `spark` the active session of the calling thread.

    Spark 4.3 looks Python data sources up in the JVM thread's active session, and a Python
    thread other than the one that built the session has none: `format("gateway")` then
    fails with DATA_SOURCE_NOT_FOUND. Call this first in such threads.
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
