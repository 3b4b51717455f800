// The plugin's devices: one per network interface, bound by its address.
//
// KVXFER_NET_IF (interface names separated by commas) names them, in that
// order; each must exist, be up and have an IPv4 address or a global IPv6
// address, or init() fails.  Empty: every interface that is up and has such
// an address, except loopback, docker* and virbr*, with the NICs local to this
// process's CPUs (hwloc) first; loopback only if nothing else is left.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::netplugin {

class Topology;

struct NetDevice {
  std::string ifname;    // "eth0"
  std::string address;   // numeric address the endpoints bind to ("192.0.2.2")
  int family = 0;        // AF_INET / AF_INET6
  std::string pci_path;  // from hwloc; "" when the interface is not on PCI (lo, veth)
  uint64_t guid = 0;     // the MAC address, or the interface index if it has none
  int speed_mbps = 0;    // /sys/class/net/<if>/speed, 10000 when unknown
  bool local = false;    // attached to the CPUs this process may run on
};

/** One interface as getifaddrs() reports it (a unit-testable input). */
struct InterfaceAddr {
  std::string ifname;
  std::string address;
  int family = 0;
  bool up = false;
  bool loopback = false;
};

/** All interfaces with an IPv4 or a non-link-local IPv6 address (getifaddrs). */
std::vector<InterfaceAddr> list_interfaces();

/**
 * Picks the devices from `ifs` as described above (`net_if` is KVXFER_NET_IF).
 * `topo` may be null.  KVXFER_ERR_INVALID_ARGUMENT names a KVXFER_NET_IF entry
 * that does not exist or has no usable address; KVXFER_ERR_UNSUPPORTED if
 * there is no interface at all.
 */
kvxfer_result_t choose_devices(const std::vector<InterfaceAddr>& ifs, const std::string& net_if,
                               const Topology* topo, std::vector<NetDevice>* out);

}  // namespace kvxfer::netplugin
