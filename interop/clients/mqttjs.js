// MQTT.js (npm "mqtt") driver: argv[2] is the JSON action; prints JSON lines (see common.py).
"use strict";
const mqtt = require("mqtt");

const a = JSON.parse(process.argv[2]);
const emit = (o) => process.stdout.write(JSON.stringify(o) + "\n");
const b64 = (buf) => Buffer.from(buf).toString("base64");

function publishProps(p) {
  const out = {};
  if (p.user_properties) {
    // MQTT.js takes an object; a repeated key becomes an array value (order of keys kept)
    out.userProperties = {};
    for (const [k, v] of p.user_properties) {
      const cur = out.userProperties[k];
      out.userProperties[k] = cur === undefined ? v : [].concat(cur, v);
    }
  }
  if (p.correlation_data) out.correlationData = Buffer.from(p.correlation_data, "base64");
  if (p.response_topic) out.responseTopic = p.response_topic;
  if (p.content_type) out.contentType = p.content_type;
  return out;
}

function propsJson(p) {
  const out = {};
  if (!p) return out;
  if (p.userProperties) {
    out.user_properties = [];
    for (const [k, v] of Object.entries(p.userProperties)) {
      for (const one of [].concat(v)) out.user_properties.push([k, one]);
    }
  }
  if (p.correlationData) out.correlation_data = b64(p.correlationData);
  if (p.responseTopic) out.response_topic = p.responseTopic;
  if (p.contentType) out.content_type = p.contentType;
  return out;
}

const options = {
  protocolVersion: a.version, clientId: a.client_id, clean: a.clean !== false,
  reconnectPeriod: 0, connectTimeout: a.timeout * 1000,
};
if (a.username) Object.assign(options, { username: a.username, password: a.password });
if (a.version === 5 && a.clean === false) options.properties = { sessionExpiryInterval: 300 };
if (a.action === "will") {
  const w = a.will;
  options.will = { topic: w.topic, payload: Buffer.from(w.payload, "base64"), qos: w.qos,
    retain: w.retain };
}
if (a.ca) options.ca = require("fs").readFileSync(a.ca);
const client = mqtt.connect(`${a.ca ? "mqtts" : "mqtt"}://${a.host}:${a.port}`, options);
const got = [];
const timer = setTimeout(() => finish({ ok: a.action === "subscribe", messages: got }),
  a.timeout * 1000);

function finish(result) {
  clearTimeout(timer);
  emit(result);
  setTimeout(() => client.end(false, {}, () => process.exit(0)), 200);
}

client.on("error", (err) => {
  clearTimeout(timer);
  emit({ ok: false, rc: err.code !== undefined ? err.code : String(err) });
  process.exit(0);
});
client.on("message", (topic, payload, packet) => {
  got.push({ topic, payload: b64(payload), qos: packet.qos, retain: packet.retain,
    props: propsJson(packet.properties) });
  if (got.length >= a.count) finish({ ok: true, messages: got });
});
client.on("connect", async () => {
  if (a.action === "will") {
    emit({ ok: true });
    client.stream.destroy();  // drop the socket without DISCONNECT: the will must fire
    process.exit(0);
  } else if (a.action === "connect") {
    finish({ ok: true });
  } else if (a.action === "publish") {
    for (const m of a.messages) {
      await client.publishAsync(m.topic, Buffer.from(m.payload, "base64"),
        { qos: m.qos, retain: !!m.retain, properties: publishProps(m.props || {}) });
    }
    finish({ ok: true });
  } else if (a.action === "subscribe") {
    for (const [topic, qos] of a.topics) await client.subscribeAsync(topic, { qos });
    emit({ event: "ready" });
    if (a.count === 0) finish({ ok: true, messages: got });
  }
});
