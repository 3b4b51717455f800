/* Prints, as JSON, what the C compiler makes of include/kvxfer/kvxfer.h:
 * sizeof and the offset of every field of every public struct, the enum
 * values, the constants, and the field values the _INITIALIZER macros set.
 * python/tests/test_abi.py compares them with the ctypes mirrors of
 * python/kvxfer/_abi.py.  Built by python/CMakeLists.txt (kvxfer_abi_dump). */
#include <stddef.h>
#include <stdio.h>

#include "kvxfer/kvxfer.h"

static int first;

static void sep(void) {
  if (!first) printf(",");
  first = 0;
}

#define BEGIN_STRUCT(T)                                                \
  sep();                                                               \
  printf("\n \"%s\": {\"sizeof\": %zu, \"fields\": {", #T, sizeof(T)); \
  first = 1;
#define FIELD(T, f) \
  sep();            \
  printf("\"%s\": %zu", #f, offsetof(T, f));
#define END_STRUCT() \
  printf("}}");      \
  first = 0;

#define ENUM(v) \
  sep();        \
  printf("\n  \"%s\": %d", #v, (int)(v));

#define INIT_BEGIN(T, init)     \
  {                             \
    T x = init;                 \
    sep();                      \
    printf("\n \"%s\": {", #T); \
    first = 1;
#define INIT_INT(f) \
  sep();            \
  printf("\"%s\": %lld", #f, (long long)x.f);
#define INIT_FLOAT(f) \
  sep();              \
  printf("\"%s\": %.9g", #f, (double)x.f);
#define INIT_PTR(f) \
  sep();            \
  printf("\"%s\": %d", #f, x.f == NULL ? 0 : 1);
#define INIT_END() \
  printf("}");     \
  first = 0;       \
  }

int main(void) {
  printf("{\"structs\": {");
  first = 1;
  BEGIN_STRUCT(kvxfer_codec_config_t)
  FIELD(kvxfer_codec_config_t, size)
  FIELD(kvxfer_codec_config_t, magic)
  FIELD(kvxfer_codec_config_t, version)
  FIELD(kvxfer_codec_config_t, codec)
  FIELD(kvxfer_codec_config_t, alpha)
  FIELD(kvxfer_codec_config_t, chunk_tokens)
  FIELD(kvxfer_codec_config_t, anchor_bits)
  FIELD(kvxfer_codec_config_t, nonfinite)
  FIELD(kvxfer_codec_config_t, sink_tokens)
  FIELD(kvxfer_codec_config_t, value_groups)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_page_layout_t)
  FIELD(kvxfer_page_layout_t, blocks)
  FIELD(kvxfer_page_layout_t, num_blocks)
  FIELD(kvxfer_page_layout_t, block_size)
  FIELD(kvxfer_page_layout_t, row_stride)
  FIELD(kvxfer_page_layout_t, first_token)
  FIELD(kvxfer_page_layout_t, num_tokens)
  FIELD(kvxfer_page_layout_t, num_channels)
  FIELD(kvxfer_page_layout_t, dtype)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_page_id_t)
  FIELD(kvxfer_page_id_t, layer)
  FIELD(kvxfer_page_id_t, kind)
  FIELD(kvxfer_page_id_t, token_begin)
  FIELD(kvxfer_page_id_t, stream_id)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_page_info_t)
  FIELD(kvxfer_page_info_t, is_residual)
  FIELD(kvxfer_page_info_t, codec)
  FIELD(kvxfer_page_info_t, raw_fallback)
  FIELD(kvxfer_page_info_t, alpha)
  FIELD(kvxfer_page_info_t, chunk_tokens)
  FIELD(kvxfer_page_info_t, anchor_bits)
  FIELD(kvxfer_page_info_t, residual_bits)
  FIELD(kvxfer_page_info_t, src_dtype)
  FIELD(kvxfer_page_info_t, meta_fp32)
  FIELD(kvxfer_page_info_t, id)
  FIELD(kvxfer_page_info_t, num_tokens)
  FIELD(kvxfer_page_info_t, num_channels)
  FIELD(kvxfer_page_info_t, section_bytes)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_unique_id_t)
  FIELD(kvxfer_unique_id_t, internal)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_comm_config_t)
  FIELD(kvxfer_comm_config_t, size)
  FIELD(kvxfer_comm_config_t, magic)
  FIELD(kvxfer_comm_config_t, version)
  FIELD(kvxfer_comm_config_t, timeout_ms)
  FIELD(kvxfer_comm_config_t, bind_address)
  FIELD(kvxfer_comm_config_t, rate_limit)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_kv_desc_t)
  FIELD(kvxfer_kv_desc_t, size)
  FIELD(kvxfer_kv_desc_t, magic)
  FIELD(kvxfer_kv_desc_t, version)
  FIELD(kvxfer_kv_desc_t, num_layers)
  FIELD(kvxfer_kv_desc_t, kv_heads)
  FIELD(kvxfer_kv_desc_t, head_dim)
  FIELD(kvxfer_kv_desc_t, dtype)
  FIELD(kvxfer_kv_desc_t, num_tokens)
  FIELD(kvxfer_kv_desc_t, block_size)
  FIELD(kvxfer_kv_desc_t, row_stride)
  FIELD(kvxfer_kv_desc_t, num_blocks)
  FIELD(kvxfer_kv_desc_t, k_blocks)
  FIELD(kvxfer_kv_desc_t, v_blocks)
  FIELD(kvxfer_kv_desc_t, device)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_request_config_t)
  FIELD(kvxfer_request_config_t, size)
  FIELD(kvxfer_request_config_t, magic)
  FIELD(kvxfer_request_config_t, version)
  FIELD(kvxfer_request_config_t, tag)
  FIELD(kvxfer_request_config_t, mode)
  FIELD(kvxfer_request_config_t, page_tokens)
  FIELD(kvxfer_request_config_t, on_anchor_ready)
  FIELD(kvxfer_request_config_t, on_complete)
  FIELD(kvxfer_request_config_t, user_data)
  FIELD(kvxfer_request_config_t, stream_layers)
  FIELD(kvxfer_request_config_t, match_by_id)
  FIELD(kvxfer_request_config_t, request_id)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_request_info_t)
  FIELD(kvxfer_request_info_t, size)
  FIELD(kvxfer_request_info_t, magic)
  FIELD(kvxfer_request_info_t, version)
  FIELD(kvxfer_request_info_t, stage)
  FIELD(kvxfer_request_info_t, result)
  FIELD(kvxfer_request_info_t, is_send)
  FIELD(kvxfer_request_info_t, peer)
  FIELD(kvxfer_request_info_t, codec)
  FIELD(kvxfer_request_info_t, mode)
  FIELD(kvxfer_request_info_t, num_pages)
  FIELD(kvxfer_request_info_t, pages_anchor_ready)
  FIELD(kvxfer_request_info_t, pages_complete)
  FIELD(kvxfer_request_info_t, kv_bytes)
  FIELD(kvxfer_request_info_t, anchor_wire_bytes)
  FIELD(kvxfer_request_info_t, residual_wire_bytes)
  FIELD(kvxfer_request_info_t, t_posted_ns)
  FIELD(kvxfer_request_info_t, t_handshake_ns)
  FIELD(kvxfer_request_info_t, t_anchor_ready_ns)
  FIELD(kvxfer_request_info_t, t_complete_ns)
  FIELD(kvxfer_request_info_t, t_error_ns)
  FIELD(kvxfer_request_info_t, t_first_residual_ns)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_arrival_t)
  FIELD(kvxfer_arrival_t, t_ns)
  FIELD(kvxfer_arrival_t, traffic_class)
  FIELD(kvxfer_arrival_t, layer)
  FIELD(kvxfer_arrival_t, bytes)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_kv_pool_desc_t)
  FIELD(kvxfer_kv_pool_desc_t, size)
  FIELD(kvxfer_kv_pool_desc_t, magic)
  FIELD(kvxfer_kv_pool_desc_t, version)
  FIELD(kvxfer_kv_pool_desc_t, num_layers)
  FIELD(kvxfer_kv_pool_desc_t, kv_heads)
  FIELD(kvxfer_kv_pool_desc_t, head_dim)
  FIELD(kvxfer_kv_pool_desc_t, dtype)
  FIELD(kvxfer_kv_pool_desc_t, block_size)
  FIELD(kvxfer_kv_pool_desc_t, num_blocks)
  FIELD(kvxfer_kv_pool_desc_t, row_stride)
  FIELD(kvxfer_kv_pool_desc_t, block_stride)
  FIELD(kvxfer_kv_pool_desc_t, k_layers)
  FIELD(kvxfer_kv_pool_desc_t, v_layers)
  FIELD(kvxfer_kv_pool_desc_t, device)
  END_STRUCT()
  BEGIN_STRUCT(kvxfer_kv_blocks_t)
  FIELD(kvxfer_kv_blocks_t, size)
  FIELD(kvxfer_kv_blocks_t, magic)
  FIELD(kvxfer_kv_blocks_t, version)
  FIELD(kvxfer_kv_blocks_t, num_tokens)
  FIELD(kvxfer_kv_blocks_t, block_ids)
  FIELD(kvxfer_kv_blocks_t, num_block_ids)
  FIELD(kvxfer_kv_blocks_t, head_begin)
  FIELD(kvxfer_kv_blocks_t, num_heads)
  END_STRUCT()
  printf("},\n\"enums\": {");
  first = 1;
  ENUM(KVXFER_SUCCESS)
  ENUM(KVXFER_IN_PROGRESS)
  ENUM(KVXFER_ERR_INVALID_ARGUMENT)
  ENUM(KVXFER_ERR_INVALID_USAGE)
  ENUM(KVXFER_ERR_BUFFER_TOO_SMALL)
  ENUM(KVXFER_ERR_NONFINITE)
  ENUM(KVXFER_ERR_TRUNCATED)
  ENUM(KVXFER_ERR_CORRUPT)
  ENUM(KVXFER_ERR_MISMATCH)
  ENUM(KVXFER_ERR_UNSUPPORTED)
  ENUM(KVXFER_ERR_SYSTEM)
  ENUM(KVXFER_ERR_INTERNAL)
  ENUM(KVXFER_ERR_OUT_OF_MEMORY)
  ENUM(KVXFER_ERR_TIMEOUT)
  ENUM(KVXFER_ERR_CANCELLED)
  ENUM(KVXFER_RESULT_MIN)
  ENUM(KVXFER_DTYPE_BF16)
  ENUM(KVXFER_DTYPE_FP16)
  ENUM(KVXFER_DTYPE_FP32)
  ENUM(KVXFER_KV_KEY)
  ENUM(KVXFER_KV_VALUE)
  ENUM(KVXFER_CODEC_LYNX)
  ENUM(KVXFER_CODEC_INT8)
  ENUM(KVXFER_CODEC_INT4)
  ENUM(KVXFER_CODEC_BF16)
  ENUM(KVXFER_CODEC_SPECTRUM)
  ENUM(KVXFER_TIER_FP16)
  ENUM(KVXFER_TIER_INT8)
  ENUM(KVXFER_TIER_INT4)
  ENUM(KVXFER_TIER_DROP)
  ENUM(KVXFER_NONFINITE_ERROR)
  ENUM(KVXFER_NONFINITE_RAW)
  ENUM(KVXFER_VALUE_GROUPS_CHANNEL)
  ENUM(KVXFER_VALUE_GROUPS_TOKEN)
  ENUM(KVXFER_VALUE_GROUPS_AUTO)
  ENUM(KVXFER_STAGE_POSTED)
  ENUM(KVXFER_STAGE_ANCHOR_READY)
  ENUM(KVXFER_STAGE_COMPLETE)
  ENUM(KVXFER_STAGE_ERROR)
  ENUM(KVXFER_MODE_AUTO)
  ENUM(KVXFER_MODE_PROGRESSIVE)
  ENUM(KVXFER_MODE_MONOLITHIC)
  printf(
      "},\n\"constants\": {\"KVXFER_CONFIG_MAGIC\": %u, \"KVXFER_VERSION_CODE\": %d, "
      "\"KVXFER_UNIQUE_ID_BYTES\": %d, \"KVXFER_ALPHA_AUTO\": %.9g, \"enum_size\": %zu},\n",
      (unsigned)KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, KVXFER_UNIQUE_ID_BYTES,
      (double)KVXFER_ALPHA_AUTO, sizeof(kvxfer_stage_t));
  printf("\"initializers\": {");
  first = 1;
  // clang-format off: one initializer field per line (the macros end without a semicolon)
  INIT_BEGIN(kvxfer_codec_config_t, KVXFER_CODEC_CONFIG_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(codec)
  INIT_FLOAT(alpha)
  INIT_INT(chunk_tokens)
  INIT_INT(anchor_bits)
  INIT_INT(nonfinite)
  INIT_INT(sink_tokens)
  INIT_INT(value_groups)
  INIT_END()
  INIT_BEGIN(kvxfer_comm_config_t, KVXFER_COMM_CONFIG_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(timeout_ms)
  INIT_PTR(bind_address)
  INIT_PTR(rate_limit)
  INIT_END()
  INIT_BEGIN(kvxfer_kv_desc_t, KVXFER_KV_DESC_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(num_layers)
  INIT_INT(kv_heads)
  INIT_INT(head_dim)
  INIT_INT(dtype)
  INIT_INT(num_tokens)
  INIT_INT(block_size)
  INIT_INT(row_stride)
  INIT_INT(num_blocks)
  INIT_PTR(k_blocks)
  INIT_PTR(v_blocks)
  INIT_INT(device)
  INIT_END()
  INIT_BEGIN(kvxfer_request_config_t, KVXFER_REQUEST_CONFIG_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(tag)
  INIT_INT(mode)
  INIT_INT(page_tokens)
  INIT_PTR(on_anchor_ready)
  INIT_PTR(on_complete)
  INIT_PTR(user_data)
  INIT_INT(stream_layers)
  INIT_INT(match_by_id)
  INIT_INT(request_id)
  INIT_END()
  INIT_BEGIN(kvxfer_request_info_t, KVXFER_REQUEST_INFO_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(stage)
  INIT_INT(result)
  INIT_INT(is_send)
  INIT_INT(peer)
  INIT_INT(codec)
  INIT_INT(mode)
  INIT_INT(num_pages)
  INIT_INT(kv_bytes)
  INIT_INT(t_posted_ns)
  INIT_INT(t_complete_ns)
  INIT_END()
  INIT_BEGIN(kvxfer_kv_pool_desc_t, KVXFER_KV_POOL_DESC_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(num_layers)
  INIT_INT(kv_heads)
  INIT_INT(head_dim)
  INIT_INT(dtype)
  INIT_INT(block_size)
  INIT_INT(num_blocks)
  INIT_INT(row_stride)
  INIT_INT(block_stride)
  INIT_PTR(k_layers)
  INIT_PTR(v_layers)
  INIT_INT(device)
  INIT_END()
  INIT_BEGIN(kvxfer_kv_blocks_t, KVXFER_KV_BLOCKS_INITIALIZER)
  INIT_INT(size)
  INIT_INT(magic)
  INIT_INT(version)
  INIT_INT(num_tokens)
  INIT_PTR(block_ids)
  INIT_INT(num_block_ids)
  INIT_INT(head_begin)
  INIT_INT(num_heads)
  INIT_END()
  printf("}}\n");
  // clang-format on
  return 0;
}
