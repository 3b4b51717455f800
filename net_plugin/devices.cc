#include "net_plugin/devices.h"

#include <arpa/inet.h>
#include <hwloc.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "common/error.h"
#include "net_plugin/topo.h"

namespace kvxfer::netplugin {

namespace {

bool starts_with(const std::string& s, const char* p) { return s.compare(0, strlen(p), p) == 0; }

uint64_t mac_to_guid(const std::string& mac) {
  unsigned b[6];
  if (std::sscanf(mac.c_str(), "%x:%x:%x:%x:%x:%x", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5]) != 6)
    return 0;
  uint64_t g = 0;
  for (unsigned v : b) g = (g << 8) | (v & 0xFF);
  return g;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

// Package os_index -> whether this process may run on one of its CPUs.
bool nic_is_local(const Nic* nic) {
  if (nic == nullptr || nic->numa < 0) return false;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return false;
  const std::string cpus =
      read_line(strprintf("/sys/devices/system/node/node%d/cpulist", nic->numa));
  // cpulist: "0-15,32-47"
  size_t pos = 0;
  while (pos < cpus.size()) {
    int a = 0, b = 0;
    int used = 0;
    if (std::sscanf(cpus.c_str() + pos, "%d-%d%n", &a, &b, &used) == 2) {
    } else if (std::sscanf(cpus.c_str() + pos, "%d%n", &a, &used) == 1) {
      b = a;
    } else {
      break;
    }
    for (int c = a; c <= b && c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) return true;
    pos += static_cast<size_t>(used);
    if (pos < cpus.size() && cpus[pos] == ',') ++pos;
  }
  return false;
}

NetDevice make_device(const InterfaceAddr& ia, const Topology* topo) {
  NetDevice d;
  d.ifname = ia.ifname;
  d.address = ia.address;
  d.family = ia.family;
  const Nic* nic = topo != nullptr ? topo->find(ia.ifname) : nullptr;
  if (nic != nullptr) d.pci_path = nic->pci_path;
  std::string mac = nic != nullptr ? nic->mac : "";
  if (mac.empty()) mac = read_line("/sys/class/net/" + ia.ifname + "/address");
  d.guid = mac_to_guid(mac);
  if (d.guid == 0) d.guid = if_nametoindex(ia.ifname.c_str());
  const std::string speed = read_line("/sys/class/net/" + ia.ifname + "/speed");
  d.speed_mbps = std::atoi(speed.c_str());
  if (d.speed_mbps <= 0) d.speed_mbps = 10000;  // virtual or unknown: NCCL's socket default
  d.local = nic_is_local(nic);
  return d;
}

}  // namespace

std::vector<InterfaceAddr> list_interfaces() {
  std::vector<InterfaceAddr> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr) continue;
    const int fam = i->ifa_addr->sa_family;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (fam == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    } else if (fam == AF_INET6) {
      const in6_addr& a = reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LINKLOCAL(&a)) continue;  // needs a scope id to bind
      inet_ntop(AF_INET6, &a, buf, sizeof(buf));
    } else {
      continue;
    }
    InterfaceAddr ia;
    ia.ifname = i->ifa_name;
    ia.address = buf;
    ia.family = fam;
    ia.up = (i->ifa_flags & IFF_UP) != 0;
    ia.loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    out.push_back(ia);
  }
  freeifaddrs(list);
  return out;
}

kvxfer_result_t choose_devices(const std::vector<InterfaceAddr>& ifs, const std::string& net_if,
                               const Topology* topo, std::vector<NetDevice>* out) {
  out->clear();
  // The preferred address of an interface: its first IPv4, else its first IPv6.
  auto best_addr = [&](const std::string& name) -> const InterfaceAddr* {
    const InterfaceAddr* v6 = nullptr;
    for (const InterfaceAddr& ia : ifs) {
      if (ia.ifname != name || !ia.up) continue;
      if (ia.family == AF_INET) return &ia;
      if (v6 == nullptr) v6 = &ia;
    }
    return v6;
  };
  if (!net_if.empty()) {
    size_t start = 0;
    while (start <= net_if.size()) {
      size_t comma = net_if.find(',', start);
      if (comma == std::string::npos) comma = net_if.size();
      const std::string name = net_if.substr(start, comma - start);
      start = comma + 1;
      if (name.empty())
        return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                         "KVXFER_NET_IF='%s' has an empty interface name", net_if.c_str());
      const InterfaceAddr* ia = best_addr(name);
      if (ia == nullptr)
        return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                         "KVXFER_NET_IF names '%s', which is not an interface that is up with an "
                         "IPv4 or global IPv6 address",
                         name.c_str());
      for (const NetDevice& d : *out)
        if (d.ifname == name)
          return set_error(KVXFER_ERR_INVALID_ARGUMENT, "KVXFER_NET_IF names '%s' twice",
                           name.c_str());
      out->push_back(make_device(*ia, topo));
    }
    return KVXFER_SUCCESS;
  }
  std::vector<std::string> names, loopbacks;
  for (const InterfaceAddr& ia : ifs) {
    if (!ia.up) continue;
    std::vector<std::string>& dst = ia.loopback ? loopbacks : names;
    if (starts_with(ia.ifname, "docker") || starts_with(ia.ifname, "virbr")) continue;
    if (std::find(dst.begin(), dst.end(), ia.ifname) == dst.end()) dst.push_back(ia.ifname);
  }
  if (names.empty()) names = loopbacks;
  if (names.empty())
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "no network interface is up with an IPv4 or global IPv6 address");
  for (const std::string& n : names) out->push_back(make_device(*best_addr(n), topo));
  std::stable_sort(out->begin(), out->end(), [](const NetDevice& a, const NetDevice& b) {
    if (a.local != b.local) return a.local;
    return a.ifname < b.ifname;
  });
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::netplugin
