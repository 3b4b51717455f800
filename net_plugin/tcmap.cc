#include "net_plugin/tcmap.h"

#include <rdma/fabric.h>
#include <strings.h>

#include <cerrno>
#include <cstdlib>

#include "common/error.h"
#include "common/params.h"
#include "transport/ofi.h"

namespace kvxfer::netplugin {

namespace {

bool parse_small_int(const std::string& s, long lo, long hi, long* out) {
  if (s.empty() || s.size() > 11) return false;
  size_t i = 0;
  if (s[0] == '-') i = 1;
  if (i == s.size()) return false;
  for (size_t j = i; j < s.size(); ++j)
    if (s[j] < '0' || s[j] > '9') return false;
  errno = 0;
  const long v = std::strtol(s.c_str(), nullptr, 10);
  if (errno != 0 || v < lo || v > hi) return false;
  *out = v;
  return true;
}

}  // namespace

std::string ClassSettings::describe() const {
  std::string s = transport::tclass_to_string(tclass);
  s += dscp >= 0 ? strprintf(", DSCP %d", dscp) : ", sockets unmarked";
  return s;
}

ClassPresets TcMap::presets_from_params() {
  ClassPresets p;
  p.anchor_dscp = static_cast<int>(params::AnchorDscp());
  p.residual_dscp = static_cast<int>(params::ResidualDscp());
  p.anchor_tclass = transport::tclass_value(params::AnchorTc(), p.anchor_dscp);
  p.residual_tclass = transport::tclass_value(params::ResidualTc(), p.residual_dscp);
  return p;
}

bool TcMap::parse(const std::string& text, const ClassPresets& presets, TcMap* out,
                  std::string* why) {
  TcMap m;
  m.text_ = text;
  if (text.empty()) {
    *why = "is empty (write e.g. " + std::string(kDefault) + ")";
    return false;
  }
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string entry = text.substr(start, comma - start);
    start = comma + 1;
    const size_t eq = entry.find('=');
    if (entry.empty() || eq == std::string::npos || eq == 0 || eq + 1 == entry.size()) {
      *why = "has an entry '" + entry + "' that is not key=value";
      return false;
    }
    const std::string key = entry.substr(0, eq);
    const std::string value = entry.substr(eq + 1);
    ClassSettings cs;
    cs.source = entry;
    bool any = false;
    long cls = 0;
    if (key == "*") {
      any = true;
    } else if (parse_small_int(key, -1, 2147483647L, &cls)) {
      cs.nccl_class = static_cast<int>(cls);
    } else {
      *why = "has a key '" + key + "' that is neither an integer >= -1 nor *";
      return false;
    }
    if (strcasecmp(value.c_str(), "anchor") == 0) {
      cs.tclass = presets.anchor_tclass;
      cs.dscp = presets.anchor_dscp;
    } else if (strcasecmp(value.c_str(), "residual") == 0) {
      cs.tclass = presets.residual_tclass;
      cs.dscp = presets.residual_dscp;
    } else {
      const size_t slash = value.find('/');
      const std::string tc = value.substr(0, slash);
      long dscp = -1;
      if (slash != std::string::npos && !parse_small_int(value.substr(slash + 1), 0, 63, &dscp)) {
        *why = "has a DSCP '" + value.substr(slash + 1) + "' in '" + entry + "' outside 0..63";
        return false;
      }
      if (strcasecmp(tc.c_str(), "DSCP") == 0 && dscp < 0) {
        *why = "has '" + entry + "': the class DSCP needs a value, e.g. DSCP/46";
        return false;
      }
      if (!transport::tclass_from_name(tc, dscp < 0 ? 0 : static_cast<int>(dscp), &cs.tclass)) {
        *why = "has an unknown traffic class '" + tc + "' in '" + entry +
               "' (allowed: anchor, residual, " + params::choices_text<params::Tclass>(", ") + ")";
        return false;
      }
      cs.dscp = static_cast<int>(dscp);
    }
    if (any) {
      if (m.has_any_) {
        *why = "has two entries for *";
        return false;
      }
      m.has_any_ = true;
      m.any_ = cs;
    } else if (!m.entries_.emplace(cs.nccl_class, cs).second) {
      *why = strprintf("has two entries for class %d", cs.nccl_class);
      return false;
    }
  }
  *out = std::move(m);
  return true;
}

bool TcMap::lookup(int nccl_class, ClassSettings* out, std::string* why) const {
  auto it = entries_.find(nccl_class);
  if (it != entries_.end()) {
    *out = it->second;
    return true;
  }
  if (has_any_) {
    *out = any_;
    out->nccl_class = nccl_class;
    return true;
  }
  *why = strprintf(
      "NCCL traffic class %d is not in KVXFER_NET_TC_MAP='%s' (add an entry %d=... or *=...)",
      nccl_class, text_.c_str(), nccl_class);
  return false;
}

}  // namespace kvxfer::netplugin
