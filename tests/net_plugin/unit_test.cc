// Unit tests of the NCCL net plugin's parts that need no network: NIC
// selection on an hwloc XML fixture (tests/net_plugin/data/topo_2s.xml: two
// sockets, four GPUs, four NIC ports), the KVXFER_NET_TC_MAP parser, and the
// choice of devices from a list of interfaces.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <hwloc.h>
#include <rdma/fabric.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "net_plugin/devices.h"
#include "net_plugin/tcmap.h"
#include "net_plugin/topo.h"

namespace kvxfer::netplugin {
namespace {

const std::string kFixture = std::string(KVXFER_TEST_DATA_DIR) + "/topo_2s.xml";

std::unique_ptr<Topology> fixture() {
  std::unique_ptr<Topology> t;
  EXPECT_EQ(Topology::load_xml(kFixture, &t), KVXFER_SUCCESS) << last_error();
  return t;
}

// ---------------------------------------------------------------------------
// Topology
// ---------------------------------------------------------------------------
TEST(NetPluginTopo, IoObjectsNeedTheKeepImportantFilter) {
  // Without the I/O filter hwloc drops every PCI and OS device of the XML.
  hwloc_topology_t t;
  ASSERT_EQ(hwloc_topology_init(&t), 0);
  ASSERT_EQ(hwloc_topology_set_xml(t, kFixture.c_str()), 0);
  ASSERT_EQ(hwloc_topology_load(t), 0);
  EXPECT_EQ(hwloc_get_next_osdev(t, nullptr), nullptr);
  EXPECT_EQ(hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE), 2);
  hwloc_topology_destroy(t);
  // With it (what Topology does), all four NIC ports are there.
  auto topo = fixture();
  ASSERT_TRUE(topo);
  ASSERT_EQ(topo->nics().size(), 4u);
}

TEST(NetPluginTopo, NicsWithBusIdsPciPathsAndSockets) {
  auto topo = fixture();
  ASSERT_TRUE(topo);
  const auto& n = topo->nics();
  ASSERT_EQ(n.size(), 4u);
  EXPECT_EQ(n[0].name, "ens1f0");
  EXPECT_EQ(n[0].pci_busid, "0000:03:00.0");
  EXPECT_EQ(n[0].pci_path, "/sys/devices/pci0000:00/0000:00:01.0/0000:01:01.0/0000:03:00.0");
  EXPECT_EQ(n[0].mac, "b8:3f:d2:00:00:10");
  EXPECT_EQ(n[0].package, 0);
  EXPECT_EQ(n[0].numa, 0);
  EXPECT_EQ(n[1].name, "ens1f1");
  EXPECT_EQ(n[1].pci_path, "/sys/devices/pci0000:00/0000:00:01.0/0000:01:01.0/0000:03:00.1");
  EXPECT_EQ(n[2].name, "ens2");
  EXPECT_EQ(n[2].pci_path, "/sys/devices/pci0000:80/0000:80:01.0/0000:81:01.0/0000:83:00.0");
  EXPECT_EQ(n[2].package, 1);
  EXPECT_EQ(n[2].numa, 1);
  EXPECT_EQ(n[3].name, "ens3");
  EXPECT_EQ(n[3].pci_path, "/sys/devices/pci0000:a0/0000:a0:01.0/0000:a1:01.0/0000:a6:00.0");
  // GPUs have paths too (NCCL compares them with the NICs').
  EXPECT_EQ(topo->pci_path_of("0000:21:00.0"), "/sys/devices/pci0000:20/0000:20:01.0/0000:21:00.0");
  EXPECT_EQ(topo->pci_path_of("a3:00.0"),
            "/sys/devices/pci0000:a0/0000:a0:01.0/0000:a1:00.0/0000:a2:00.0/0000:a3:00.0");
  EXPECT_EQ(topo->pci_path_of("0000:55:00.0"), "");
  EXPECT_NE(topo->find("ens2"), nullptr);
  EXPECT_EQ(topo->find("eth0"), nullptr);
}

TEST(NetPluginTopo, ClosestNicToEachGpu) {
  auto topo = fixture();
  ASSERT_TRUE(topo);
  struct Case {
    const char* gpu;
    const char* nic;
    Distance d;
    int bridges;
  } cases[] = {
      {"0000:02:00.0", "ens1f0", Distance::kPix, 2},   // GPU0: same PCIe switch; ties -> first port
      {"0000:21:00.0", "ens1f0", Distance::kNode, 5},  // GPU1: other root complex, same socket
      {"0000:82:00.0", "ens2", Distance::kPix, 2},     // GPU2: same switch, socket 1
      {"a3:00.0", "ens3", Distance::kPxb, 3},          // GPU3: nested switches
  };
  for (const Case& c : cases) {
    NicChoice ch;
    ASSERT_EQ(topo->closest_to_pci(c.gpu, &ch), KVXFER_SUCCESS) << c.gpu << ": " << last_error();
    EXPECT_EQ(ch.nic, c.nic) << c.gpu;
    EXPECT_EQ(ch.distance, c.d) << c.gpu << ": " << distance_name(ch.distance);
    EXPECT_EQ(ch.bridges, c.bridges) << c.gpu;
    EXPECT_FALSE(ch.overridden);
  }
  // The whole ranking of GPU0: its switch, then nothing else on socket 0, then
  // socket 1's NICs across the inter-socket link.
  std::vector<NicChoice> all;
  ASSERT_EQ(topo->rank_for_pci("0000:02:00.0", &all), KVXFER_SUCCESS);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].nic, "ens1f0");
  EXPECT_EQ(all[1].nic, "ens1f1");
  EXPECT_EQ(all[1].distance, Distance::kPix);
  EXPECT_EQ(all[2].distance, Distance::kSys);
  EXPECT_EQ(all[3].distance, Distance::kSys);
  // GPU3: its nested switch beats the other switch of the same socket.
  ASSERT_EQ(topo->rank_for_pci("0000:a3:00.0", &all), KVXFER_SUCCESS);
  EXPECT_EQ(all[0].nic, "ens3");
  EXPECT_EQ(all[1].nic, "ens2");
  EXPECT_EQ(all[1].distance, Distance::kNode);
}

TEST(NetPluginTopo, ClosestNicToEachCpu) {
  auto topo = fixture();
  ASSERT_TRUE(topo);
  for (int cpu = 0; cpu < 8; ++cpu) {
    NicChoice ch;
    ASSERT_EQ(topo->closest_to_cpu(cpu, &ch), KVXFER_SUCCESS) << last_error();
    EXPECT_EQ(ch.nic, cpu < 4 ? "ens1f0" : "ens2") << "cpu " << cpu;
    EXPECT_EQ(ch.distance, Distance::kNode);
  }
  std::vector<NicChoice> all;
  ASSERT_EQ(topo->rank_for_cpu(5, &all), KVXFER_SUCCESS);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[1].nic, "ens3");
  EXPECT_EQ(all[2].distance, Distance::kSys);
  NicChoice ch;
  EXPECT_EQ(topo->select("cpu:6", "", &ch), KVXFER_SUCCESS);
  EXPECT_EQ(ch.nic, "ens2");
  EXPECT_EQ(topo->closest_to_cpu(8, &ch), KVXFER_ERR_INVALID_ARGUMENT);
}

TEST(NetPluginTopo, KvxferNetIfOverridesTheChoice) {
  auto topo = fixture();
  ASSERT_TRUE(topo);
  NicChoice ch;
  ASSERT_EQ(topo->select("0000:02:00.0", "ens3,ens2", &ch), KVXFER_SUCCESS);
  EXPECT_EQ(ch.nic, "ens3");
  EXPECT_TRUE(ch.overridden);
  ASSERT_EQ(topo->select("0000:02:00.0", "", &ch), KVXFER_SUCCESS);
  EXPECT_EQ(ch.nic, "ens1f0");
  // A named NIC that does not exist is an error, never a silent fallback.
  EXPECT_EQ(topo->select("0000:02:00.0", "eth9", &ch), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("eth9"), std::string::npos);
}

TEST(NetPluginTopo, RejectsUnknownDevicesAndBadBusIds) {
  auto topo = fixture();
  ASSERT_TRUE(topo);
  NicChoice ch;
  EXPECT_EQ(topo->closest_to_pci("0000:55:00.0", &ch), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(topo->closest_to_pci("gpu0", &ch), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(topo->closest_to_pci("0000:02:00.9", &ch), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(topo->select("cpu:x", "", &ch), KVXFER_ERR_INVALID_ARGUMENT);
  std::unique_ptr<Topology> t;
  EXPECT_NE(Topology::load_xml(kFixture + ".missing", &t), KVXFER_SUCCESS);
}

TEST(NetPluginTopo, LiveSystemLoads) {
  std::unique_ptr<Topology> t;
  ASSERT_EQ(Topology::load_system(&t), KVXFER_SUCCESS) << last_error();
  for (const Nic& n : t->nics()) {
    EXPECT_EQ(n.pci_path.compare(0, 16, "/sys/devices/pci"), 0) << n.name << " " << n.pci_path;
    char real[4096];
    const std::string link = "/sys/class/net/" + n.name + "/device";
    if (realpath(link.c_str(), real) != nullptr) {
      EXPECT_EQ(std::string(real).compare(0, n.pci_path.size(), n.pci_path), 0)
          << n.name << ": hwloc path " << n.pci_path << ", sysfs " << real;
    }
  }
}

// ---------------------------------------------------------------------------
// KVXFER_NET_TC_MAP
// ---------------------------------------------------------------------------
ClassPresets presets() {
  ClassPresets p;
  p.anchor_tclass = FI_TC_LOW_LATENCY;
  p.anchor_dscp = 46;
  p.residual_tclass = FI_TC_BULK_DATA;
  p.residual_dscp = 8;
  return p;
}

TEST(NetPluginTcMap, DefaultMapsAnchorAndResidual) {
  TcMap m;
  std::string why;
  ASSERT_TRUE(TcMap::parse(TcMap::kDefault, presets(), &m, &why)) << why;
  ClassSettings cs;
  ASSERT_TRUE(m.lookup(0, &cs, &why));
  EXPECT_EQ(cs.tclass, uint32_t{FI_TC_LOW_LATENCY});
  EXPECT_EQ(cs.dscp, 46);
  EXPECT_EQ(cs.describe(), "LOW_LATENCY, DSCP 46");
  ASSERT_TRUE(m.lookup(1, &cs, &why));
  EXPECT_EQ(cs.tclass, uint32_t{FI_TC_BULK_DATA});
  EXPECT_EQ(cs.dscp, 8);
  ASSERT_TRUE(m.lookup(-1, &cs, &why));
  EXPECT_EQ(cs.tclass, uint32_t{FI_TC_UNSPEC});
  EXPECT_EQ(cs.dscp, -1);
  EXPECT_EQ(cs.describe(), "UNSPEC, sockets unmarked");
  EXPECT_FALSE(m.lookup(2, &cs, &why));
  EXPECT_NE(why.find("NCCL traffic class 2 is not in KVXFER_NET_TC_MAP"), std::string::npos) << why;
}

TEST(NetPluginTcMap, NamesDscpAndWildcard) {
  TcMap m;
  std::string why;
  ASSERT_TRUE(
      TcMap::parse("106=DSCP/26,32=bulk_data/8,5=residual,*=BEST_EFFORT", presets(), &m, &why))
      << why;
  ClassSettings cs;
  ASSERT_TRUE(m.lookup(106, &cs, &why));
  EXPECT_EQ(cs.tclass, fi_tc_dscp_set(26));
  EXPECT_EQ(cs.dscp, 26);
  ASSERT_TRUE(m.lookup(32, &cs, &why));
  EXPECT_EQ(cs.tclass, uint32_t{FI_TC_BULK_DATA});
  EXPECT_EQ(cs.dscp, 8);
  ASSERT_TRUE(m.lookup(5, &cs, &why));
  EXPECT_EQ(cs.dscp, 8);
  ASSERT_TRUE(m.lookup(12345, &cs, &why));  // '*'
  EXPECT_EQ(cs.tclass, uint32_t{FI_TC_BEST_EFFORT});
  EXPECT_EQ(cs.dscp, -1);
  EXPECT_EQ(cs.nccl_class, 12345);
  ASSERT_TRUE(m.lookup(-1, &cs, &why));  // '*' covers "not set" too
}

TEST(NetPluginTcMap, RejectsMalformedMaps) {
  const char* bad[] = {
      "",           // empty
      "0",          // no value
      "=anchor",    // no key
      "0=",         // no value
      "0=anchor,",  // empty entry
      "0=anchor,,1=residual",
      "x=anchor",          // key not an integer
      "-2=anchor",         // below -1
      "0=FAST",            // unknown class
      "0=DSCP",            // DSCP without a value
      "0=LOW_LATENCY/64",  // DSCP out of range
      "0=LOW_LATENCY/-1",
      "0=LOW_LATENCY/4x",
      "0=anchor,0=residual",  // duplicate key
      "*=anchor,*=residual",
      " 0=anchor",  // spaces are not allowed
      "0=anchor ",
  };
  for (const char* text : bad) {
    TcMap m;
    std::string why;
    EXPECT_FALSE(TcMap::parse(text, presets(), &m, &why)) << "'" << text << "' accepted";
    EXPECT_FALSE(why.empty()) << text;
  }
}

// ---------------------------------------------------------------------------
// Devices from interfaces
// ---------------------------------------------------------------------------
InterfaceAddr ifa(const char* name, const char* addr, int fam = AF_INET, bool up = true,
                  bool loopback = false) {
  InterfaceAddr a;
  a.ifname = name;
  a.address = addr;
  a.family = fam;
  a.up = up;
  a.loopback = loopback;
  return a;
}

TEST(NetPluginDevices, DefaultSkipsLoopbackDockerAndDownInterfaces) {
  const std::vector<InterfaceAddr> ifs = {ifa("lo", "127.0.0.1", AF_INET, true, true),
                                          ifa("docker0", "172.17.0.1"),
                                          ifa("eth1", "10.0.0.2"),
                                          ifa("eth0", "fd00::2", AF_INET6),
                                          ifa("eth0", "192.0.2.2"),
                                          ifa("ib0", "10.1.0.2", AF_INET, false)};
  std::vector<NetDevice> d;
  ASSERT_EQ(choose_devices(ifs, "", nullptr, &d), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0].ifname, "eth0");
  EXPECT_EQ(d[0].address, "192.0.2.2");  // IPv4 preferred
  EXPECT_EQ(d[1].ifname, "eth1");
  // Only loopback left: loopback.
  ASSERT_EQ(choose_devices({ifs[0], ifs[1]}, "", nullptr, &d), KVXFER_SUCCESS);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0].ifname, "lo");
  EXPECT_NE(d[0].guid, 0u);
  EXPECT_GT(d[0].speed_mbps, 0);
  EXPECT_EQ(choose_devices({}, "", nullptr, &d), KVXFER_ERR_UNSUPPORTED);
}

TEST(NetPluginDevices, KvxferNetIfNamesDevicesInOrder) {
  const std::vector<InterfaceAddr> ifs = {
      ifa("lo", "127.0.0.1", AF_INET, true, true), ifa("eth0", "192.0.2.2"),
      ifa("eth1", "fd00::3", AF_INET6), ifa("ib0", "10.1.0.2", AF_INET, false)};
  std::vector<NetDevice> d;
  ASSERT_EQ(choose_devices(ifs, "eth1,lo,eth0", nullptr, &d), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0].ifname, "eth1");
  EXPECT_EQ(d[0].address, "fd00::3");
  EXPECT_EQ(d[0].family, AF_INET6);
  EXPECT_EQ(d[1].ifname, "lo");
  EXPECT_EQ(d[2].ifname, "eth0");
  for (const char* bad : {"eth9", "ib0" /* down */, "eth0,", "eth0,eth0", ","}) {
    EXPECT_EQ(choose_devices(ifs, bad, nullptr, &d), KVXFER_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(last_error()).find("KVXFER_NET_IF"), std::string::npos) << bad;
  }
}

TEST(NetPluginDevices, ListsThisMachinesLoopback) {
  bool lo = false;
  for (const InterfaceAddr& a : list_interfaces())
    if (a.ifname == "lo" && a.address == "127.0.0.1") lo = a.loopback && a.up;
  EXPECT_TRUE(lo);
}

}  // namespace
}  // namespace kvxfer::netplugin
