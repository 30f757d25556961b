"""Packet captures: the scapy dissector for Nezha frames and the per-rail pcap report."""
