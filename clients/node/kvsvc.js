'use strict';
// Node.js client of kvsvc.v1. Loads kv_transfer.proto at runtime (uint64 as strings, enums
// as strings, field names as in the .proto), turns google.rpc.Status error details into
// KvsvcError {code, reason, metadata}, and retries idempotent calls that never reached a
// server. The .proto is the repository's protos/ when used from a checkout, and the copy
// `npm pack` puts into the package (proto/, see package.json) once installed elsewhere.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const fs = require('fs');

const PACKED = path.resolve(__dirname, 'proto');
const PROTO_ROOT = process.env.KVSVC_PROTO_ROOT
  || (fs.existsSync(PACKED) ? PACKED : path.resolve(__dirname, '..', '..', 'protos'));
const PROTO_FILE = 'kvsvc/v1/kv_transfer.proto';

const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [PROTO_ROOT] };

// The few google.rpc messages an error carries, declared here so no extra .proto is needed.
const rpcTypes = protobuf.Root.fromJSON({
  nested: {
    google: { nested: {
      protobuf: { nested: { Any: { fields: { type_url: { type: 'string', id: 1 }, value: { type: 'bytes', id: 2 } } } } },
      rpc: { nested: {
        Status: { fields: { code: { type: 'int32', id: 1 }, message: { type: 'string', id: 2 },
                            details: { rule: 'repeated', type: 'google.protobuf.Any', id: 3 } } },
        ErrorInfo: { fields: { reason: { type: 'string', id: 1 }, domain: { type: 'string', id: 2 },
                               metadata: { keyType: 'string', type: 'string', id: 3 } } },
        BadRequest: { fields: { field_violations: { rule: 'repeated', type: 'FieldViolation', id: 1 } },
                      nested: { FieldViolation: { fields: { field: { type: 'string', id: 1 }, description: { type: 'string', id: 2 } } } } },
      } },
    } },
  },
});
const Status = rpcTypes.lookupType('google.rpc.Status');
const ErrorInfo = rpcTypes.lookupType('google.rpc.ErrorInfo');
const BadRequest = rpcTypes.lookupType('google.rpc.BadRequest');

const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, value]) => [value, name]));

class KvsvcError extends Error {
  constructor(code, reason, message, metadata, fieldViolations) {
    super(`${reason}: ${message}`);
    this.name = 'KvsvcError';
    this.code = code;                 // e.g. 'FAILED_PRECONDITION'
    this.reason = reason;             // e.g. 'LEASE_EXPIRED'
    this.metadata = metadata || {};   // the offending values
    this.fieldViolations = fieldViolations || [];
  }
}

function toKvsvcError(err) {
  const code = CODE_NAMES[err.code] || 'UNKNOWN';
  let reason = code;
  let metadata = {};
  let violations = [];
  let message = err.details || err.message;
  const raw = err.metadata && err.metadata.get('grpc-status-details-bin');
  if (raw && raw.length) {
    const status = Status.decode(raw[0]);
    message = status.message || message;
    for (const any of status.details) {
      if (any.type_url.endsWith('/google.rpc.ErrorInfo')) {
        const info = ErrorInfo.decode(any.value);
        reason = info.reason;
        metadata = { ...info.metadata };
      } else if (any.type_url.endsWith('/google.rpc.BadRequest')) {
        violations = BadRequest.decode(any.value).field_violations.map((v) => ({ field: v.field, description: v.description }));
      }
    }
  }
  if (message && message.startsWith(`${reason}: `)) message = message.slice(reason.length + 2);
  return new KvsvcError(code, reason, message, metadata, violations);
}

function loadService() {
  const def = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
  return grpc.loadPackageDefinition(def).kvsvc.v1.KvTransferService;
}

const UNARY = {
  getInfo: 'GetInfo', handshake: 'Handshake', publishBlocks: 'PublishBlocks', claimLease: 'ClaimLease',
  planTransfer: 'PlanTransfer', transfer: 'Transfer', notify: 'Notify', waitTransfer: 'WaitTransfer',
  listLeases: 'ListLeases',
};
// Safe to send twice: a Transfer joins its running job by request id, a claim with the
// same claim id is granted again, a notification is applied once. PublishBlocks is not
// (a second call would lease the blocks again), so it is never retried.
const IDEMPOTENT = new Set(['GetInfo', 'Handshake', 'ClaimLease', 'PlanTransfer', 'Transfer', 'Notify', 'WaitTransfer',
  'ListLeases']);

// UNAVAILABLE with no kvsvc ErrorInfo: the call never reached a kvsvc server (connection
// refused, reset before an answer); a server's own UNAVAILABLE answer carries a reason.
function neverReached(err) {
  const details = err.metadata && err.metadata.get('grpc-status-details-bin');
  return err.code === grpc.status.UNAVAILABLE && !(details && details.length);
}

const sleep = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

class KvsvcClient {
  // retries: extra attempts of an idempotent call that never reached the server, backoffMs
  // apart (doubling, jittered), all within the call's own deadline; onRetry(rpc, attempt, err)
  // is called before each.
  constructor(address, { timeoutMs = 30000, credentials, retries = 2, backoffMs = 100, onRetry } = {}) {
    const Service = loadService();
    this.raw = new Service(address, credentials || grpc.credentials.createInsecure());
    this.timeoutMs = timeoutMs;
    this.retries = retries;
    this.backoffMs = backoffMs;
    this.onRetry = onRetry;
    for (const [method, rpc] of Object.entries(UNARY)) {
      this[method] = (request = {}, { timeoutMs: t } = {}) => this._unary(rpc, request, t);
    }
  }

  async _unary(rpc, request, timeoutMs) {
    const end = Date.now() + (timeoutMs || this.timeoutMs);
    const attempts = IDEMPOTENT.has(rpc) ? this.retries + 1 : 1;
    let delay = this.backoffMs;
    for (let attempt = 1; ; attempt += 1) {
      try {
        return await this._once(rpc, request, new Date(end));
      } catch (err) {
        const wait = delay * (0.5 + Math.random());
        if (attempt >= attempts || !neverReached(err) || Date.now() + wait >= end) throw toKvsvcError(err);
        if (this.onRetry) this.onRetry(rpc, attempt, toKvsvcError(err));
        await sleep(wait);
        delay *= 2;
      }
    }
  }

  _once(rpc, request, deadline) {
    return new Promise((resolve, reject) => {
      this.raw[rpc](request, { deadline }, (err, response) => (err ? reject(err) : resolve(response)));
    });
  }

  // Async iterator over released requests; call .cancel() on the returned stream to stop.
  watchReleases() {
    const call = this.raw.WatchReleases({});
    const iterator = (async function* iterate() {
      try {
        for await (const event of call) yield event;
      } catch (err) {
        if (err.code !== grpc.status.CANCELLED) throw toKvsvcError(err);
      }
    })();
    iterator.cancel = () => call.cancel();
    return iterator;
  }

  close() { this.raw.close(); }
}

const blocks = (...groups) => groups.map((ids) => ({ block_ids: ids }));

module.exports = { KvsvcClient, KvsvcError, toKvsvcError, blocks, loadService, PROTO_ROOT };
