// NIC topology through hwloc: which network interfaces sit on which PCI
// function, their sysfs PCI path (what NCCL reads as pciPath), and which NIC
// is closest to a given GPU (PCI bus id) or CPU.
//
// I/O objects exist in an hwloc topology only when the I/O filter keeps them,
// so every topology here is loaded with
// hwloc_topology_set_io_types_filter(HWLOC_TYPE_FILTER_KEEP_IMPORTANT),
// from the running system or from an XML file (the tests' fixture).
//
// Distance classes, nearest first (the names NCCL uses for GPU-NIC paths):
//   PIX   through at most one PCIe bridge (the same PCIe switch)
//   PXB   through several PCIe bridges, not through the host bridge
//   PHB   through a PCIe host bridge (the same root complex)
//   NODE  different host bridges under the same NUMA node or package
//   SYS   across packages (the inter-socket link)
// Ties go to fewer bridges on the path, then to the NIC listed first.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

struct hwloc_topology;
struct hwloc_obj;

namespace kvxfer::netplugin {

enum class Distance : int { kPix = 0, kPxb = 1, kPhb = 2, kNode = 3, kSys = 4 };
const char* distance_name(Distance d);

/** A network interface that hwloc found on a PCI function. */
struct Nic {
  std::string name;       // OS interface name ("eth0", "ens1f0")
  std::string pci_busid;  // "0000:17:00.0"
  std::string pci_path;   // "/sys/devices/pci0000:16/0000:16:02.0/0000:17:00.0"
  std::string mac;        // hwloc's "Address" info ("" if absent)
  int package = -1;       // os_index of the package it hangs under (-1: none)
  int numa = -1;          // os_index of the first NUMA node of its locality (-1: none)
};

/** The answer of a closest-NIC query. */
struct NicChoice {
  std::string nic;  // interface name
  Distance distance = Distance::kSys;
  int bridges = 0;          // PCIe bridges on the path (PCI targets only)
  bool overridden = false;  // named by the override, not chosen by distance
};

class Topology {
 public:
  /** Loads the running system's topology (I/O objects: KEEP_IMPORTANT). */
  static kvxfer_result_t load_system(std::unique_ptr<Topology>* out);
  /** Loads an hwloc XML file (the same I/O filter). */
  static kvxfer_result_t load_xml(const std::string& path, std::unique_ptr<Topology>* out);
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  /** Network interfaces on PCI, in topology order. */
  const std::vector<Nic>& nics() const { return nics_; }
  /** The NIC with this interface name, or nullptr. */
  const Nic* find(const std::string& ifname) const;

  /**
   * The NIC closest to the PCI device `busid` ("0000:17:00.0", or "17:00.0"
   * for domain 0), for example a GPU.  Fails if there is no such device or no
   * NIC at all.
   */
  kvxfer_result_t closest_to_pci(const std::string& busid, NicChoice* out) const;
  /** The NIC closest to the logical processor with OS index `cpu`. */
  kvxfer_result_t closest_to_cpu(int cpu, NicChoice* out) const;
  /** Every NIC with its distance to the PCI device `busid`, nearest first. */
  kvxfer_result_t rank_for_pci(const std::string& busid, std::vector<NicChoice>* out) const;
  /** Every NIC with its distance to CPU `cpu` (NODE or SYS), nearest first. */
  kvxfer_result_t rank_for_cpu(int cpu, std::vector<NicChoice>* out) const;
  /**
   * `target` is "cpu:N" or a PCI bus id.  A non-empty `override_list` (the
   * value of KVXFER_NET_IF: interface names separated by commas) wins: its
   * first name is the answer, and it must be a NIC of this topology.
   */
  kvxfer_result_t select(const std::string& target, const std::string& override_list,
                         NicChoice* out) const;

  /** The sysfs path of the PCI function `busid`, built from the bridges above it ("" if none). */
  std::string pci_path_of(const std::string& busid) const;

 private:
  Topology() = default;
  static kvxfer_result_t load(const std::string* xml_path, std::unique_ptr<Topology>* out);
  void scan();
  hwloc_topology* topo_ = nullptr;
  std::vector<Nic> nics_;
  std::vector<hwloc_obj*> nic_pci_;  // the PCI object of each nics_[i]
};

}  // namespace kvxfer::netplugin
