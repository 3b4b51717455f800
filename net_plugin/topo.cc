#include "net_plugin/topo.h"

#include <hwloc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "common/error.h"

namespace kvxfer::netplugin {

namespace {

bool is_host_bridge(hwloc_obj_t o) {
  return o->type == HWLOC_OBJ_BRIDGE && o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST;
}
bool is_pci_bridge(hwloc_obj_t o) {
  return o->type == HWLOC_OBJ_BRIDGE && o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI;
}

std::string busid_string(const hwloc_obj_attr_u::hwloc_pcidev_attr_s& a) {
  return strprintf("%04x:%02x:%02x.%x", static_cast<unsigned>(a.domain),
                   static_cast<unsigned>(a.bus), static_cast<unsigned>(a.dev),
                   static_cast<unsigned>(a.func));
}

// The first ancestor that is not an I/O object (a package, NUMA node, group
// or the machine): the object the device is attached to.
hwloc_obj_t locality(hwloc_obj_t o) {
  while (o != nullptr && hwloc_obj_type_is_io(o->type)) o = o->parent;
  return o;
}

hwloc_obj_t common_ancestor(hwloc_obj_t a, hwloc_obj_t b) {
  std::vector<hwloc_obj_t> chain;
  for (hwloc_obj_t o = a; o != nullptr; o = o->parent) chain.push_back(o);
  for (hwloc_obj_t o = b; o != nullptr; o = o->parent)
    if (std::find(chain.begin(), chain.end(), o) != chain.end()) return o;
  return nullptr;
}

int bridges_between(hwloc_obj_t from, hwloc_obj_t ancestor) {
  int n = 0;
  for (hwloc_obj_t o = from->parent; o != nullptr && o != ancestor; o = o->parent)
    if (o->type == HWLOC_OBJ_BRIDGE) ++n;
  return n;
}

hwloc_obj_t ancestor_of_type(hwloc_obj_t o, hwloc_obj_type_t type) {
  for (; o != nullptr; o = o->parent)
    if (o->type == type) return o;
  return nullptr;
}

// "0000:17:00.0" or "17:00.0" -> normalized "0000:17:00.0"; "" if malformed.
std::string normalize_busid(const std::string& s) {
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  char tail = 0;
  if (std::sscanf(s.c_str(), "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) == 4) {
  } else if (std::sscanf(s.c_str(), "%x:%x.%x%c", &bus, &dev, &fn, &tail) == 3) {
    dom = 0;
  } else {
    return "";
  }
  if (dom > 0xffff || bus > 0xff || dev > 0x1f || fn > 0x7) return "";
  return strprintf("%04x:%02x:%02x.%x", dom, bus, dev, fn);
}

}  // namespace

const char* distance_name(Distance d) {
  switch (d) {
    case Distance::kPix: return "PIX";
    case Distance::kPxb: return "PXB";
    case Distance::kPhb: return "PHB";
    case Distance::kNode: return "NODE";
    case Distance::kSys: return "SYS";
  }
  return "?";
}

Topology::~Topology() {
  if (topo_ != nullptr) hwloc_topology_destroy(topo_);
}

kvxfer_result_t Topology::load_system(std::unique_ptr<Topology>* out) { return load(nullptr, out); }

kvxfer_result_t Topology::load_xml(const std::string& path, std::unique_ptr<Topology>* out) {
  return load(&path, out);
}

kvxfer_result_t Topology::load(const std::string* xml_path, std::unique_ptr<Topology>* out) {
  std::unique_ptr<Topology> t(new Topology());
  if (hwloc_topology_init(&t->topo_) != 0) {
    t->topo_ = nullptr;
    return set_error(KVXFER_ERR_SYSTEM, "hwloc_topology_init failed");
  }
  // Without this filter hwloc drops every PCI device and OS device.
  if (hwloc_topology_set_io_types_filter(t->topo_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0)
    return set_error(KVXFER_ERR_SYSTEM, "hwloc_topology_set_io_types_filter failed");
  if (xml_path != nullptr && hwloc_topology_set_xml(t->topo_, xml_path->c_str()) != 0)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "hwloc cannot read the XML topology %s",
                     xml_path->c_str());
  if (hwloc_topology_load(t->topo_) != 0)
    return set_error(KVXFER_ERR_SYSTEM, "hwloc_topology_load failed%s%s",
                     xml_path != nullptr ? " for " : "",
                     xml_path != nullptr ? xml_path->c_str() : "");
  t->scan();
  *out = std::move(t);
  return KVXFER_SUCCESS;
}

void Topology::scan() {
  for (hwloc_obj_t o = hwloc_get_next_osdev(topo_, nullptr); o != nullptr;
       o = hwloc_get_next_osdev(topo_, o)) {
    if (o->attr->osdev.type != HWLOC_OBJ_OSDEV_NETWORK || o->name == nullptr) continue;
    hwloc_obj_t pci = o->parent;
    if (pci == nullptr || pci->type != HWLOC_OBJ_PCI_DEVICE) continue;
    Nic n;
    n.name = o->name;
    n.pci_busid = busid_string(pci->attr->pcidev);
    n.pci_path = pci_path_of(n.pci_busid);
    if (const char* mac = hwloc_obj_get_info_by_name(o, "Address")) n.mac = mac;
    hwloc_obj_t loc = locality(pci);
    if (hwloc_obj_t pkg = ancestor_of_type(loc, HWLOC_OBJ_PACKAGE))
      n.package = static_cast<int>(pkg->os_index);
    if (loc != nullptr && loc->nodeset != nullptr && !hwloc_bitmap_iszero(loc->nodeset))
      n.numa = hwloc_bitmap_first(loc->nodeset);
    nics_.push_back(std::move(n));
    nic_pci_.push_back(pci);
  }
}

const Nic* Topology::find(const std::string& ifname) const {
  for (const Nic& n : nics_)
    if (n.name == ifname) return &n;
  return nullptr;
}

std::string Topology::pci_path_of(const std::string& busid) const {
  const std::string norm = normalize_busid(busid);
  if (norm.empty()) return "";
  hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo_, norm.c_str());
  if (dev == nullptr) return "";
  // /sys/devices/pci<domain>:<root bus>/<bridge>/.../<device>
  std::vector<std::string> parts;
  parts.push_back(norm);
  for (hwloc_obj_t o = dev->parent; o != nullptr && hwloc_obj_type_is_io(o->type); o = o->parent) {
    if (is_pci_bridge(o)) {
      parts.push_back(busid_string(o->attr->bridge.upstream.pci));
    } else if (is_host_bridge(o)) {
      parts.push_back(
          strprintf("pci%04x:%02x", static_cast<unsigned>(o->attr->bridge.downstream.pci.domain),
                    static_cast<unsigned>(o->attr->bridge.downstream.pci.secondary_bus)));
      break;
    }
  }
  if (parts.size() < 2 || parts.back().compare(0, 3, "pci") != 0) {
    // No host bridge above it (hwloc did not report one): the root bus is the
    // device's own bus.
    parts.push_back(strprintf("pci%s", norm.substr(0, 7).c_str()));
  }
  std::string path = "/sys/devices";
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) path += "/" + *it;
  return path;
}

kvxfer_result_t Topology::rank_for_pci(const std::string& busid,
                                       std::vector<NicChoice>* out) const {
  out->clear();
  const std::string norm = normalize_busid(busid);
  if (norm.empty())
    return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                     "'%s' is not a PCI bus id (expected e.g. 0000:17:00.0)", busid.c_str());
  hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo_, norm.c_str());
  if (dev == nullptr)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "no PCI device %s in the topology", norm.c_str());
  if (nics_.empty()) return set_error(KVXFER_ERR_UNSUPPORTED, "the topology has no network NIC");
  std::vector<std::tuple<int, int, size_t>> keys;
  for (size_t i = 0; i < nics_.size(); ++i) {
    hwloc_obj_t nic = nic_pci_[i];
    hwloc_obj_t anc = common_ancestor(dev, nic);
    Distance d;
    const int bd = bridges_between(dev, anc), bn = bridges_between(nic, anc);
    const int bridges = bd + bn;
    if (anc != nullptr && is_pci_bridge(anc)) {
      // hwloc shows a PCIe switch as its upstream port (the common ancestor)
      // with one bridge per downstream port: one level on each side is PIX.
      d = std::max(bd, bn) <= 1 ? Distance::kPix : Distance::kPxb;
    } else if (anc != nullptr && is_host_bridge(anc)) {
      d = Distance::kPhb;
    } else if (anc != nullptr && anc->type == HWLOC_OBJ_PCI_DEVICE) {
      d = Distance::kPix;  // the device is the NIC itself
    } else {
      // Different root complexes: the same NUMA node or package, or another socket.
      hwloc_obj_t ld = locality(dev), ln = locality(nic);
      hwloc_obj_t pd = ancestor_of_type(ld, HWLOC_OBJ_PACKAGE);
      hwloc_obj_t pn = ancestor_of_type(ln, HWLOC_OBJ_PACKAGE);
      const bool same_node = ld == ln || (pd != nullptr && pd == pn);
      d = same_node ? Distance::kNode : Distance::kSys;
    }
    keys.emplace_back(static_cast<int>(d), bridges, i);
  }
  std::sort(keys.begin(), keys.end());
  for (const auto& k : keys) {
    NicChoice c;
    c.nic = nics_[std::get<2>(k)].name;
    c.distance = static_cast<Distance>(std::get<0>(k));
    c.bridges = std::get<1>(k);
    out->push_back(c);
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Topology::rank_for_cpu(int cpu, std::vector<NicChoice>* out) const {
  out->clear();
  if (cpu < 0) return set_error(KVXFER_ERR_INVALID_ARGUMENT, "cpu %d is negative", cpu);
  hwloc_obj_t pu = hwloc_get_pu_obj_by_os_index(topo_, static_cast<unsigned>(cpu));
  if (pu == nullptr)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "no CPU %d in the topology", cpu);
  if (nics_.empty()) return set_error(KVXFER_ERR_UNSUPPORTED, "the topology has no network NIC");
  // Nearest: a NIC whose locality holds the CPU, the smallest locality first.
  std::vector<std::tuple<int, int, size_t>> keys;
  for (size_t i = 0; i < nics_.size(); ++i) {
    hwloc_obj_t loc = locality(nic_pci_[i]);
    const bool has_set = loc != nullptr && loc->cpuset != nullptr;
    const bool local = has_set && hwloc_bitmap_isset(loc->cpuset, static_cast<unsigned>(cpu));
    const int weight = has_set ? hwloc_bitmap_weight(loc->cpuset) : 1 << 29;
    keys.emplace_back(static_cast<int>(local ? Distance::kNode : Distance::kSys), weight, i);
  }
  std::sort(keys.begin(), keys.end());
  for (const auto& k : keys) {
    NicChoice c;
    c.nic = nics_[std::get<2>(k)].name;
    c.distance = static_cast<Distance>(std::get<0>(k));
    out->push_back(c);
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Topology::closest_to_pci(const std::string& busid, NicChoice* out) const {
  std::vector<NicChoice> all;
  KVXFER_CHECK(rank_for_pci(busid, &all));
  *out = all.front();
  return KVXFER_SUCCESS;
}

kvxfer_result_t Topology::closest_to_cpu(int cpu, NicChoice* out) const {
  std::vector<NicChoice> all;
  KVXFER_CHECK(rank_for_cpu(cpu, &all));
  *out = all.front();
  return KVXFER_SUCCESS;
}

kvxfer_result_t Topology::select(const std::string& target, const std::string& override_list,
                                 NicChoice* out) const {
  if (!override_list.empty()) {
    const std::string first = override_list.substr(0, override_list.find(','));
    if (find(first) == nullptr)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "KVXFER_NET_IF names '%s', which is not a NIC of this topology",
                       first.c_str());
    out->nic = first;
    out->distance = Distance::kSys;
    out->bridges = 0;
    out->overridden = true;
    return KVXFER_SUCCESS;
  }
  if (target.compare(0, 4, "cpu:") == 0) {
    char* end = nullptr;
    const long cpu = std::strtol(target.c_str() + 4, &end, 10);
    if (end == target.c_str() + 4 || *end != '\0' || cpu < 0 || cpu > (1 << 20))
      return set_error(KVXFER_ERR_INVALID_ARGUMENT, "'%s' is not cpu:N", target.c_str());
    return closest_to_cpu(static_cast<int>(cpu), out);
  }
  return closest_to_pci(target, out);
}

}  // namespace kvxfer::netplugin
