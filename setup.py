"""Packaging read from settings.ini (the nbdev 2 convention), so there is one place for metadata."""
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    license='Apache-2.0',
    keywords=cfg['keywords'].split(),
    packages=setuptools.find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    include_package_data=True,
    python_requires='>=' + cfg['min_python'],
    install_requires=cfg['requirements'].split(),
    extras_require={'plot': cfg['plot_requirements'].split(),
                    'export': cfg['export_requirements'].split(),
                    'hf': cfg['hf_requirements'].split(),
                    'titan': cfg['titan_requirements'].split(),
                    'dev': cfg['dev_requirements'].split()},
    entry_points={'console_scripts': cfg['console_scripts'].split(),
                  'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
)
