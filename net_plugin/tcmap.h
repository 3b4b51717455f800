// KVXFER_NET_TC_MAP: from NCCL's per-communicator trafficClass to the network
// class the plugin's endpoints use (libfabric tx_attr.tclass and the DSCP
// written into the provider's sockets).
//
//   KVXFER_NET_TC_MAP = entry[,entry...]
//   entry  = key=value
//   key    = an integer >= -1 (the NCCL trafficClass; -1 = not set), or * (any
//            class without its own entry)
//   value  = anchor | residual | TC[/DSCP]
//   TC     = a KVXFER_*_TC name (KVXFER_TRAFFIC_CLASSES in common/params.h:
//            UNSPEC, ..., NETWORK_CTRL)
//   DSCP   = 0..63: mark the sockets with it; omitted = leave them unmarked.
//            TC "DSCP" requires it and means FI_TC_DSCP | DSCP.
//
// "anchor" and "residual" stand for the transport's own settings
// (KVXFER_ANCHOR_TC + KVXFER_ANCHOR_DSCP, KVXFER_RESIDUAL_TC +
// KVXFER_RESIDUAL_DSCP).  The default is "-1=UNSPEC,0=anchor,1=residual".
// A class that the map does not cover (and no '*') is an error at init().
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace kvxfer::netplugin {

/** What a communicator's endpoints use. */
struct ClassSettings {
  int nccl_class = -1;           // NCCL's trafficClass (-1: not set)
  uint32_t tclass = 0;           // tx_attr.tclass (FI_TC_*)
  int dscp = -1;                 // 0..63, or -1: sockets left unmarked
  std::string source;            // the map entry that produced it, for logs ("0=anchor")
  std::string describe() const;  // "LOW_LATENCY, DSCP 46"
};

/** The transport settings that "anchor" and "residual" refer to. */
struct ClassPresets {
  uint32_t anchor_tclass = 0;
  int anchor_dscp = -1;
  uint32_t residual_tclass = 0;
  int residual_dscp = -1;
};

class TcMap {
 public:
  static constexpr const char* kDefault = "-1=UNSPEC,0=anchor,1=residual";

  /** Parses the text above; false with the reason (naming the entry) if malformed. */
  static bool parse(const std::string& text, const ClassPresets& presets, TcMap* out,
                    std::string* why);
  /** Presets from KVXFER_ANCHOR_TC/DSCP and KVXFER_RESIDUAL_TC/DSCP. */
  static ClassPresets presets_from_params();

  /** The settings of NCCL class `nccl_class`; false (and why) if the map lacks it. */
  bool lookup(int nccl_class, ClassSettings* out, std::string* why) const;
  size_t size() const { return entries_.size() + (has_any_ ? 1 : 0); }
  const std::string& text() const { return text_; }

 private:
  std::map<int, ClassSettings> entries_;
  bool has_any_ = false;
  ClassSettings any_;
  std::string text_;
};

}  // namespace kvxfer::netplugin
