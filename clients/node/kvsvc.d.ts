// Types of the kvsvc Node.js client (field names as in kv_transfer.proto; uint64 values are strings).

export interface BlockIds { block_ids: number[] }
export interface TransferParams {
  remote_address: string; remote_engine_id: string; remote_request_id: string;
  remote_block_ids_per_group: BlockIds[]; remote_epoch: string; remote_tp_size: number; lease_token: string;
  remote_servers?: { address: string; ranks: number[]; epoch: string }[];
  remote_dcp_size?: number; remote_num_tokens?: string;
}
export interface RegionInfo {
  region_index: number; kind: string; group_index: number; layer_name: string; pool_offset_bytes: string;
  base_address: string; block_len_bytes: string; block_stride_bytes: string; num_blocks: number;
}
export interface PoolInfo {
  tp_rank: number; memory_kind: string; shm_name: string; size_bytes: string; device_id: number; regions: RegionInfo[];
  cuda_ipc: Record<string, unknown> | null;
}
export interface GetInfoResponse {
  engine_id: string; role: string; tp_size: number; hosted_ranks: number[]; layout: Record<string, unknown>;
  layout_hash: string; epoch: string; pools: PoolInfo[];
  transport: { nixl_available: boolean; backends: string[]; ucx_transports: string[]; nixl_version: string };
  server_version: string; capabilities: string[]; advertised_address: string; live_leases: number;
}
export interface PublishBlocksResponse { params: TransferParams; lease_expires_unix_ms: string }
export interface SourceReads { remote_rank: number; bytes: string; num_descriptors: number; ranges: unknown[] }
export interface RankPlan {
  local_rank: number; tp_ratio: number; handshake_target_ranks: number[]; source_ranks: number[];
  notify_only_ranks: number[]; reads: SourceReads[]; bytes: string; num_descriptors: number;
}
export interface PlanTransferResponse { rank_plans: RankPlan[]; total_bytes: string; total_descriptors: number }
export interface TransferResponse {
  ranks: { local_rank: number; bytes: string; num_descriptors: number; duration_us: string }[];
  total_bytes: string; duration_us: string;
}
export interface NotifyResponse { state: string; pending_ranks: number[] }
export interface WaitTransferResponse {
  state: string; result: TransferResponse | null;
  failure: { valid_local_block_ids_per_group: BlockIds[]; remote_notified: boolean } | null; error_reason: string;
}
export interface ReleaseEvent { request_id: string; reason: string; block_ids_per_group: BlockIds[]; released_unix_ms: string }

export class KvsvcError extends Error {
  code: string; reason: string; metadata: Record<string, string>;
  fieldViolations: { field: string; description: string }[];
}

interface CallOptions { timeoutMs?: number }

export class KvsvcClient {
  constructor(address: string, options?: {
    timeoutMs?: number; credentials?: unknown;
    /** extra attempts of an idempotent call that never reached the server (default 2; PublishBlocks: never) */
    retries?: number;
    /** first pause between attempts, doubling, jittered (default 100) */
    backoffMs?: number;
    onRetry?: (rpc: string, attempt: number, error: KvsvcError) => void;
  });
  getInfo(request?: {}, options?: CallOptions): Promise<GetInfoResponse>;
  handshake(request: Record<string, unknown>, options?: CallOptions): Promise<Record<string, unknown>>;
  publishBlocks(request: { request_id: string; block_ids_per_group: BlockIds[]; lease_ttl_ms?: number; num_tokens?: number | string }, options?: CallOptions): Promise<PublishBlocksResponse>;
  claimLease(request: Record<string, unknown>, options?: CallOptions): Promise<{ lease_expires_unix_ms: string; lease_remaining_ms: number }>;
  planTransfer(request: Record<string, unknown>, options?: CallOptions): Promise<PlanTransferResponse>;
  transfer(request: { request_id: string; params: TransferParams; local_block_ids_per_group: BlockIds[]; local_prefix_tokens?: number }, options?: CallOptions): Promise<TransferResponse>;
  notify(request: Record<string, unknown>, options?: CallOptions): Promise<NotifyResponse>;
  // Settled state of a D-side transfer (after a cancelled or failed Transfer, before reusing its blocks).
  waitTransfer(request: { request_id: string; wait_ms?: number }, options?: CallOptions): Promise<WaitTransferResponse>;
  listLeases(request?: { limit?: number; request_id_prefix?: string; request_ids?: string[] }, options?: CallOptions): Promise<Record<string, unknown>>;
  // Progressive leases (PublishBlocks with progressive: true): P's next chunk, and D's claimant waiting for it.
  commitBlocks(request: { request_id: string; lease_token: string; commit_epoch: number; block_ids_per_group: BlockIds[]; num_tokens?: number | string; final?: boolean }, options?: CallOptions): Promise<{ commit_epoch: number; lease_expires_unix_ms: string }>;
  waitCommit(request: { request_id: string; lease_epoch: number | string; engine_id: string; claim_id: string; after_epoch: number; wait_ms?: number }, options?: CallOptions): Promise<{ commit_epoch: number; final: boolean; block_ids_per_group: BlockIds[]; num_tokens: string; lease_remaining_ms: number }>;
  watchReleases(): AsyncIterableIterator<ReleaseEvent> & { cancel(): void };
  // Transfers as messages on one TransferStream (what an engine that runs many uses).
  transferStream(): TransferChannel;
  close(): void;
}

export class TransferChannel {
  // As KvsvcClient.transfer; the same answers and errors.
  transfer(request: { request_id: string; params: TransferParams; local_block_ids_per_group: BlockIds[]; local_prefix_tokens?: number }, options?: CallOptions): Promise<TransferResponse>;
  close(): void;
}

export function blocks(...groups: number[][]): BlockIds[];

/** Every reason kvsvc's errors carry (the .proto's ErrorReason without its prefix), name -> name. */
export const REASONS: Readonly<Record<string, string>>;
