// The prefill side of examples/disagg_demo: what a serving runtime's prefill
// node does.  It runs the model's prefill over a prompt and sends the KV to
// the decode process with kvxfer_send, on the communicator the decode process
// set up (kvxfer_comm_init as rank 1).  The messages from the decode process
// only stand in for a scheduler (disagg.h).
#include <kvxfer/kvxfer.h>
#include <kvxfer/spec.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "examples/disagg.h"
#include "perf/common/pipe_msg.h"

namespace disagg {
namespace {

std::vector<float> softmax(const std::vector<float>& logits, float temperature) {
  std::vector<float> p(logits.size());
  const float mx = *std::max_element(logits.begin(), logits.end());
  double s = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = std::exp((logits[i] - mx) / temperature);
    s += p[i];
  }
  for (float& x : p) x = static_cast<float>(x / s);
  return p;
}

}  // namespace

/** BOS, then tokens sampled from the model (temperature; seed), to `len` tokens. */
std::vector<int> make_prompt(const km::Model& m, int len, uint64_t seed, float temperature) {
  std::vector<int> t = {1};
  km::KVCache tail;
  std::vector<float> logits;
  std::string err;
  while (static_cast<int>(t.size()) < len) {
    const int pos = static_cast<int>(t.size()) - 1;
    if (!m.decode_step(t.back(), pos, km::KVView{}, &tail, &logits, &err)) die("%s", err.c_str());
    int32_t next = km::argmax(logits.data(), logits.size());
    if (temperature > 0) {
      const std::vector<float> p = softmax(logits, temperature);
      CHECK_KVXFER(kvxfer_spec_sample(p.data(), static_cast<int32_t>(p.size()),
                                      seed * 1000003 + static_cast<uint64_t>(pos), &next));
    }
    t.push_back(next);
  }
  return t;
}

int prefill_main(const Options& o, int in_fd, int out_fd) {
  alarm(1800);  // never outlive a hung parent for long
  std::string err;
  std::unique_ptr<km::Model> model = km::Model::load(o.model_path, &err);
  if (!model) die("prefill: %s", err.c_str());
  const km::Config& c = model->config();
  std::map<int, BlockKV> kvs;  // prompt id -> prefill KV (all but the last prompt token)
  kvxfer_comm_t comm = nullptr;
  std::string rate;
  for (;;) {
    uint32_t kind = 0;
    std::vector<uint8_t> body;
    if (!kvxfer::perf::recv_msg(in_fd, &kind, &body, 600000, "the decode process", &err))
      die("prefill: parent went silent: %s", err.c_str());
    switch (kind) {
      case kMsgComm: {
        kvxfer_unique_id_t id;
        std::memcpy(&id, body.data(), sizeof id);
        rate.assign(reinterpret_cast<const char*>(body.data()) + sizeof id,
                    body.size() - sizeof id);
        kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
        cfg.rate_limit = rate.c_str();
        CHECK_KVXFER(kvxfer_comm_init(&comm, 2, id, 1, &cfg));
        break;
      }
      case kMsgPrompt: {
        const PromptMsg pm = as<PromptMsg>(body);
        std::vector<int> tokens;
        if (pm.given > 0) {
          const int32_t* g = reinterpret_cast<const int32_t*>(body.data() + sizeof(PromptMsg));
          tokens.assign(g, g + pm.given);
        } else {
          tokens = make_prompt(*model, pm.len, pm.seed, pm.temperature);
        }
        km::PrefillResult pre;
        const std::vector<int> head(tokens.begin(), tokens.end() - 1);
        if (!model->prefill(head, {}, &pre, &err)) die("prefill: %s", err.c_str());
        BlockKV& kv = kvs[pm.id];
        kv.init(c, static_cast<int>(head.size()));
        for (int l = 0; l < c.n_layers; ++l) {
          std::memcpy(kv.k[l].data(), pre.kv.k(l), kv.k[l].size() * sizeof(float));
          std::memcpy(kv.v[l].data(), pre.kv.v(l), kv.v[l].size() * sizeof(float));
        }
        std::vector<int32_t> out(tokens.begin(), tokens.end());
        send_msg(out_fd, kMsgTokens, out.data(), out.size() * sizeof(int32_t));
        break;
      }
      case kMsgXfer: {
        const XferMsg x = as<XferMsg>(body);
        auto it = kvs.find(x.prompt_id);
        if (it == kvs.end() || comm == nullptr) die("prefill: transfer before prompt/comm");
        const kvxfer_kv_desc_t d = it->second.desc(c, x.kv_tokens);
        kvxfer_codec_config_t codec;
        kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
        codec_of(static_cast<Mode>(x.mode), &codec, &rc.mode);
        rc.tag = x.tag;
        rc.page_tokens = x.page_tokens;
        kvxfer_request_t req = nullptr;
        const int64_t t_post = now_ns();
        CHECK_KVXFER(kvxfer_send(comm, 0, &d, &codec, &rc, &req));
        send_msg(out_fd, kMsgPosted, &t_post, sizeof t_post);
        DoneMsg done{};
        done.result = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1);
        if (done.result != KVXFER_SUCCESS)
          std::snprintf(done.error, sizeof done.error, "%s", kvxfer_get_last_error());
        CHECK_KVXFER(kvxfer_request_free(req));
        send_msg(out_fd, kMsgDone, &done, sizeof done);
        break;
      }
      case kMsgEndComm:
        CHECK_KVXFER(kvxfer_comm_destroy(comm));
        comm = nullptr;
        break;
      case kMsgQuit:
        if (comm != nullptr) kvxfer_comm_destroy(comm);
        return 0;
      default: die("prefill: unknown message %u", kind);
    }
  }
}

}  // namespace disagg
